"""Simulator-backed environments: sim/lattice-constant-v0, sim/structure-search-v0 and (cascade_bonds)
materials/cascade-chgnet-pyscf-v0."""

from labrl.envs.sim.lattice import LatticeConstantEnv
from labrl.envs.sim.search import StructureSearchEnv

__all__ = ["LatticeConstantEnv", "StructureSearchEnv"]
