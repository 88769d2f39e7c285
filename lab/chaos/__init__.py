"""The chaos run (`python -m k8s_dispatch.lab.chaos`, `make chaos`): the whole system abused on a
seeded schedule, then checked for anything lost, doubled, wrong or left over."""
