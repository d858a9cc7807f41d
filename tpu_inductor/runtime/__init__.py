"""Running compiled graphs: devices, a call's plan, transfer and execution, residency and host
sync, the transfer ledger, hoisted weights, eager regions, and the run-time half of shapes
(dispatch by size, bucket padding)."""
