from textutil import slugify

assert slugify("Hello World") == "hello-world"
assert slugify("  RL360: fast & async!  ") == "rl360-fast-async"
print("ok")
