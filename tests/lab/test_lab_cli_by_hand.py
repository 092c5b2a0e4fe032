"""``labrl lab submit | status | journal``: look at a lab and a journal by hand."""

from __future__ import annotations

import asyncio
import json

from labrl.cli import main
from labrl.lab_adapters.job_journal import Journal


def test_submit_then_status_against_the_mock_lab(mock_lab, api_key, capsys):
    request = json.dumps({"kind": "echo", "payload": {"x": 1}})
    assert main(["lab", "submit", "--url", mock_lab.url, request, "--wait", "20"]) == 0
    submitted = json.loads(capsys.readouterr().out)
    assert submitted["state"] == "completed" and submitted["result"]["echo"] == {"x": 1}
    assert submitted["idempotency_key"].startswith("lab-cli-")
    assert main(["lab", "submit", "--url", mock_lab.url, request]) == 0  # same request: same job
    assert json.loads(capsys.readouterr().out)["job_id"] == submitted["job_id"]
    assert main(["lab", "status", "--url", mock_lab.url, submitted["job_id"]]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "completed"


def test_wrong_key_is_one_line(mock_lab, monkeypatch, capsys):
    monkeypatch.setenv("LABRL_LAB_API_KEY", "not-the-token")
    rc = main(["lab", "submit", "--url", mock_lab.url, '{"kind": "echo", "payload": 1}'])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "HTTP 403" in err and "LABRL_LAB_API_KEY" in err
    assert "not-the-token" not in err


def test_journal_lists_counts_and_entries(tmp_path, capsys):
    path = tmp_path / "j.sqlite"

    async def fill() -> None:
        journal = Journal(path)
        await journal.record("k-1", {"a": 1})
        await journal.record("k-2", {"a": 2})
        await journal.reject("k-2", "HTTP 422: bad recipe")
        await journal.close()

    asyncio.run(fill())
    assert main(["lab", "journal", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 job(s): 1 pending, 1 rejected" in out and "HTTP 422: bad recipe" in out
    assert main(["lab", "journal", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["counts"] == {"pending": 1, "rejected": 1} and len(data["entries"]) == 2


def test_bad_journal_needs_fresh(tmp_path, capsys):
    path = tmp_path / "j.sqlite"
    path.write_bytes(b"")
    assert main(["lab", "journal", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "empty" in err and "--fresh" in err
    assert main(["lab", "journal", str(path), "--fresh"]) == 0
    assert "set aside" in capsys.readouterr().out
