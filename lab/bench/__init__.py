"""The benchmarks of k8s-dispatch: `python -m k8s_dispatch.lab.bench` (`make bench`), the figures the issues set as targets. One module
per benchmark (dispatch_throughput, api_load, sweep_scale, cluster_speed, adapter), sharing the
timing helpers (timing), the result model (results), the sizes (sizes), the services they run
against (services) and what they create (workload). See README.md, "Benchmarks".
"""
