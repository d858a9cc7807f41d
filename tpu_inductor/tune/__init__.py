"""Profile and tune: where a program's time, memory and traffic go (`tpu_inductor.profile`,
`tpu-inductor profile`), read from the runtime's ledgers and the ranges debug/profiling.py
opens."""
