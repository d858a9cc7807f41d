"""Lowering rules, one module per op family; `registry.load_rules` imports them."""
