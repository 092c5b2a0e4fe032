"""Simulator-backed environments: sim/lattice-constant-v0 and sim/structure-search-v0."""

from labrl.envs.sim.lattice import LatticeConstantEnv
from labrl.envs.sim.search import StructureSearchEnv

__all__ = ["LatticeConstantEnv", "StructureSearchEnv"]
