"""`labrl serve sglang`: command building, and a supervised server process end to end on CPU.

The end-to-end test launches the fake server module (LocalSampler on an
exported tiny MoE checkpoint) through the same Supervisor that launches a
real SGLang, then samples and updates weights through SGLangSampler.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import numpy as np
import pytest
import torch

from labrl.cli import main
from labrl.errors import ConfigError
from labrl.harness.models.build import build_gpt_model
from labrl.harness.models.hf_export import TINY_MOE_QWEN3, export_hf_checkpoint, hf_weights
from labrl.harness.samplers.sglang.dist import WeightBroadcaster
from labrl.harness.samplers.sglang.launch import Supervisor, server_command
from labrl.harness.samplers.sglang.sampler import SGLangSampler, SGLangSamplerConfig
from labrl.harness.types import GenerateRequest, SamplingParams
from labrl.ports import free_port, free_restart_port

SMALL = TINY_MOE_QWEN3.model_copy(
    update={
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 96,
        "moe_ffn_hidden_size": 48,
        "max_sequence_length": 128,
    }
)
FAKE = f"{sys.executable} -m labrl.testing.fake_sglang_server"


def test_server_command_adds_labrl_flags_once():
    cmd = server_command("/ckpt", "0.0.0.0", 30001, ["--tp-size", "2"], launcher="sglang-launch")
    assert cmd == [
        "sglang-launch", "--model-path", "/ckpt", "--host", "0.0.0.0", "--port", "30001",
        "--enable-return-routed-experts", "--weight-version", "0", "--tp-size", "2",
    ]  # fmt: skip
    cmd = server_command("/c", "h", 1, ["--weight-version=7", "--enable-return-routed-experts"], launcher="x")
    assert cmd.count("--enable-return-routed-experts") == 1 and "0" not in cmd


def test_cli_dry_run(capsys):
    assert (
        main(
            [
                "serve",
                "sglang",
                "--model",
                "/m",
                "--port",
                "3",
                "--launcher",
                "L",
                "--dry-run",
                "--",
                "--tp-size",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip()
    assert (
        out
        == "L --model-path /m --host 127.0.0.1 --port 3 --enable-return-routed-experts --weight-version 0 --tp-size 4"
    )


@pytest.mark.parametrize(
    ("port", "restarts", "warned"), [(30000, "3", False), (44819, "3", True), (44819, "0", False)]
)
def test_cli_warns_when_a_restarted_server_could_lose_its_port(capsys, monkeypatch, port, restarts, warned):
    monkeypatch.setattr("labrl.commands.serve.ephemeral_port_range", lambda: (32768, 60999))
    argv = ["serve", "sglang", "--model", "/m", "--port", str(port), "--max-restarts", restarts]
    assert main([*argv, "--launcher", "L", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert ("ephemeral range 32768-60999" in err) == warned


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_supervised_fake_server_end_to_end(tmp_path):
    torch.set_num_threads(2)
    model = build_gpt_model(SMALL, seed=3)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    ckpt = export_hf_checkpoint(state, SMALL, tmp_path / "v0")
    port = free_restart_port()  # killed and restarted on this port below
    url = f"http://127.0.0.1:{port}"
    sup = Supervisor(
        server_command(str(ckpt), "127.0.0.1", port, [], launcher=FAKE), url, ready_timeout_s=180
    )
    runner = threading.Thread(target=lambda: setattr(sup, "code", sup.run()), daemon=True)
    runner.start()
    try:
        while not sup.log:  # first readiness
            await _sleep(0.2, runner)
        cfg = SGLangSamplerConfig(
            urls=(url,), num_hidden_layers=2, moe_layers=(0, 1), topk=2, export_dir=str(tmp_path / "exports")
        )
        writer = lambda w, p: export_hf_checkpoint(w, SMALL, p, tokenizer=False)  # noqa: E731
        async with SGLangSampler(cfg, weight_writer=writer) as sampler:
            req = GenerateRequest(
                rid="e2e/0",
                input_ids=(1, 2, 3, 4),
                sampling=SamplingParams(max_new_tokens=6, temperature=0.0),
                return_routed_experts=True,
            )
            (res,) = await sampler.generate([req])
            assert len(res.output_ids) == 6 and res.versions_T == [0] * 6
            assert all(np.isfinite(res.logprobs_T)) and max(res.logprobs_T) <= 0.0
            assert res.routed_experts_T_L_K.shape == (10, 2, 2)
            assert ((0 <= res.routed_experts_T_L_K) & (res.routed_experts_T_L_K < SMALL.num_experts)).all()
            # weights move through an HF checkpoint on disk; the server tags later tokens 1
            new = {k: v * 1.5 if "embedding" in k else v for k, v in state.items()}
            await sampler.update_weights(new, 1)
            (res2,) = await sampler.generate([req.model_copy(update={"rid": "e2e/1"})])
            assert res2.versions_T == [1] * 6
            assert res2.logprobs_T != res.logprobs_T
        # the distributed transport: this process broadcasts over a gloo group the server joined
        dcfg = cfg.model_copy(
            update={"weight_transport": "distributed", "group_backend": "gloo", "master_port": free_port()}
        )
        to_hf = lambda w: hf_weights(w, SMALL)  # noqa: E731  (HF names: what SGLang's load_weights maps)
        async with SGLangSampler(dcfg, broadcaster=WeightBroadcaster(), to_hf=to_hf) as sampler:
            assert sampler.version == 1
            await sampler.update_weights(state, 2)  # back to the v0 weights, as version 2
            (res3,) = await sampler.generate([req.model_copy(update={"rid": "e2e/2"})])
            assert res3.versions_T == [2] * 6
            assert res3.output_ids == res.output_ids
            assert res3.logprobs_T == pytest.approx(res.logprobs_T, abs=1e-5)
        # the supervisor restarts a server that dies
        os.killpg(sup.proc.pid, signal.SIGKILL)
        while len(sup.log) < 3:
            await _sleep(0.2, runner)
        assert sup.restarts == 1 and sup.log[1].startswith("exited with code -9; restart 1/3")
    finally:
        sup.max_restarts = 0
        sup.stop()
        runner.join(timeout=30)


async def _sleep(seconds: float, runner: threading.Thread) -> None:
    import asyncio

    if not runner.is_alive():
        raise AssertionError("supervisor thread ended early")
    await asyncio.sleep(seconds)


def test_cli_python_tp_and_deterministic(capsys, tmp_path):
    """--python runs SGLang from its own environment; --deterministic adds the flag sampling_seed needs."""
    argv = ["serve", "sglang", "--python", "/opt/sg/bin/python", "--model", "/m", "--tp", "2"]
    assert main([*argv, "--deterministic", "--dry-run"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == (
        "/opt/sg/bin/python -m sglang.launch_server --model-path /m --host 127.0.0.1 --port 30000 "
        "--enable-return-routed-experts --weight-version 0 --enable-deterministic-inference --tp-size 2"
    )


def test_server_python_without_sglang_is_a_clear_error():
    from labrl.errors import SamplerError
    from labrl.harness.samplers.sglang.launch import check_server_python

    # this test environment has no sglang (the learner's environment never installs it)
    with pytest.raises(SamplerError, match=r"cannot import sglang .*ModuleNotFoundError"):
        check_server_python(sys.executable)
    with pytest.raises(SamplerError, match="no such interpreter"):
        check_server_python("/nonexistent/python")


def test_launch_fields_build_the_command(tmp_path, capsys):
    """The sampler.sglang launch_* fields: `labrl serve sglang --run-config RUN.yaml` starts that server."""
    import yaml

    from labrl.harness.samplers.sglang.launch import launch_command
    from labrl.harness.samplers.sglang.sampler import SGLangSamplerConfig

    cfg = SGLangSamplerConfig(
        urls=("http://10.0.0.5:31000",),
        launch_python="/env/bin/python",
        launch_model_path="/ckpt",
        launch_tp_size=4,
        export_dir="/x",
        deterministic_inference=True,
    )
    cmd = launch_command(cfg)
    assert cmd[:5] == ["/env/bin/python", "-m", "sglang.launch_server", "--model-path", "/ckpt"]
    assert cmd[cmd.index("--host") + 1] == "10.0.0.5" and cmd[cmd.index("--port") + 1] == "31000"
    assert "--enable-deterministic-inference" in cmd and cmd[cmd.index("--tp-size") + 1] == "4"
    with pytest.raises(ConfigError, match=r"sampler\.sglang\.launch_python is not set"):
        launch_command(cfg.model_copy(update={"launch_python": None}))
    run = {
        "env": {"id": "xrd/phase-id-v0"},
        "sampler": {
            "kind": "sglang",
            "sglang": {
                "urls": ["http://127.0.0.1:30001"],
                "export_dir": str(tmp_path),
                "launch_python": "/opt/sg/bin/python",
                "launch_model_path": "/m",
            },
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    assert main(["serve", "sglang", "--run-config", str(tmp_path / "run.yaml"), "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == (
        "/opt/sg/bin/python -m sglang.launch_server --model-path /m --host 127.0.0.1 --port 30001 "
        "--enable-return-routed-experts --weight-version 0 --tp-size 1"
    )


def test_sampler_config_errors_name_the_key():
    from pydantic import ValidationError

    from labrl.harness.samplers.sglang.sampler import SGLangSamplerConfig

    with pytest.raises(ValidationError, match=r"sampler\.sglang\.urls is empty"):
        SGLangSamplerConfig(export_dir="/x")
    with pytest.raises(
        ValidationError,
        match=r"weight_transport 'disk' requires export_dir \(sampler\.sglang\.export_dir",
    ):
        SGLangSamplerConfig(urls=("http://h:1",))
    with pytest.raises(ValidationError, match="bucket_mb"):
        SGLangSamplerConfig(urls=("http://h:1",), weight_transport="distributed", bucket_mb=0)
    with pytest.raises(ValidationError, match="extra_forbidden"):
        SGLangSamplerConfig(urls=("http://h:1",), export_dir="/x", bucket_size=3)
    # extra="forbid", frozen, and round-trips as a YAML-able dict
    cfg = SGLangSamplerConfig(urls=("http://h:1",), weight_transport="distributed", bucket_mb=64)
    assert SGLangSamplerConfig.model_validate(cfg.model_dump()) == cfg
