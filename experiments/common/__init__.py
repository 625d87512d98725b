"""What the experiment scripts share; every script imports from here, and no script imports another.

One concern a module: `paths` (where things are), `workloads` (trace -> requests, greedy params, how two
outputs compare), `timing` (timers, peak RSS), `machine` (measured peaks and the "machine" block of every
result), `programs` (the library's paged forward over step inputs the library packs, and its FLOPs),
`models` (random-weight GGUF files of real geometries), `engine_runs` (the engine timed over a workload,
checked against the dense reference), `peers` (scripts run in .venv-ref) and `report` (options, tables,
goals, the result JSON). Importing the package needs only the stdlib and numpy; jax and jaxinfer are
imported where they are used. Nothing outside experiments/ imports it.
"""
