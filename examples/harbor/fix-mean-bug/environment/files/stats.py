def mean(xs):
    """Arithmetic mean of a non-empty list of numbers."""
    return sum(xs) / (len(xs) - 1)
