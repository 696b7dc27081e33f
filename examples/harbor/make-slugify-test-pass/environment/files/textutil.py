def slugify(text):
    raise NotImplementedError("slugify")
