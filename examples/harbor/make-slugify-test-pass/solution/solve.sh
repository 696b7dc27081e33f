#!/bin/bash
cat > /app/textutil.py <<'PY'
import re


def slugify(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
PY
cd /app && python3 test_textutil.py
