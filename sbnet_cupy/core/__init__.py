"""The machinery every op family shares: kernel sources and compilation (kernels), argument
records (records), launches (launch) and argument checks (checks)."""
