#!/bin/bash
cd /app
python3 -c '
import csv
rows = list(csv.DictReader(open("jobs.csv")))
print(sum(1 for r in rows if r["status"] == "ok" and int(r["seconds"]) < 60))
' > count.txt
