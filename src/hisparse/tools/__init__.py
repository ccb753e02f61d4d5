"""What is not the library: the capability probe, the benchmarks' building blocks, the
simulator and the planner, which the `hisparse` CLI drives. The cache itself never imports
them."""
