"""Prints a checksum of a small generated data set."""

values = [(i * 37 + 11) % 101 for i in range(200)]
print(sum(v for v in values if v % 3 == 0))
