"""The benchmarks of k8s-dispatch: `python -m bench` (`make bench`). One module per benchmark
family (cluster_speed, polling, adapter, delivery_speed, recovery_speed), sharing the timing
helpers (timing), the result model (results), the services they run against (services) and
what they create (workload). See bench/README.md.
"""
