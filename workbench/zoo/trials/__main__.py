"""``python -m workbench.zoo.trials``: the doctor on every trial program, written to its table."""
from . import write_table

print(write_table())
