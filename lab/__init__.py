"""The lab: the real control plane and node, the benchmarks and the chaos harness that prove the
product. Not in the wheel; nothing of the product or the demo imports it."""
