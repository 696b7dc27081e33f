#!/bin/bash
cd /app
sed -i 's|return sum(xs) / (len(xs) - 1)|return sum(xs) / len(xs)|' stats.py
