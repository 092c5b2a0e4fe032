"""Registrations of the environments that ship with labrl.

Entry points are lazy ``module:attr`` strings: listing envs imports nothing
heavy. Third-party packages register theirs through the ``labrl.envs``
entry-point group instead (see ``labrl.envs.registry``).
"""

from __future__ import annotations

from labrl.envs.registry import register


def register_builtin_envs() -> None:
    register("judged/science-qa-v0", entry_point="labrl.envs.judged:ScienceQAEnv")
    register("xrd/phase-id-v0", entry_point="labrl.envs.xrd:PhaseIdEnv")
    register("xrd/phase-id-tools-v0", entry_point="labrl.envs.xrd:PhaseIdToolsEnv")
    register("xrd/phase-id-v1", entry_point="labrl.envs.xrd:PhaseIdEnvV1")
    register("xrd/phase-id-tools-v1", entry_point="labrl.envs.xrd:PhaseIdToolsEnvV1")
    register("sim/lattice-constant-v0", entry_point="labrl.envs.sim:LatticeConstantEnv")
    register("sim/structure-search-v0", entry_point="labrl.envs.sim:StructureSearchEnv")
    register("lab/synthesis-v0", entry_point="labrl.envs.lab:SynthesisEnv")
    register("lab/synthesis-multiturn-v0", entry_point="labrl.envs.lab:SynthesisMultiTurnEnv")
    register("synthetic/cascade-v0", entry_point="labrl.envs.cascade.synthetic:SyntheticCascadeEnv")
    register("materials/cascade-chgnet-pyscf-v0", entry_point="labrl.envs.sim.cascade_bonds:BondCascadeEnv")
