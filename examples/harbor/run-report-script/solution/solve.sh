#!/bin/bash
cd /app
python3 make_report.py > answer.txt
