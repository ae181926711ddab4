"""The simulator: the policy core over a virtual clock (docs/simulator.md)."""

# targets of the profile's own topology (`profile_topology`, `talaria sim` without --config):
# 10 s TTFT, the only figure the paper states (§2.4); the TPOT target and round margin `talaria sim` has used
TOPOLOGY_TTFT_S, TOPOLOGY_TPOT_S, TOPOLOGY_GAMMA = 10.0, 0.2, 0.8
