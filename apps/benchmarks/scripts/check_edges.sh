#!/usr/bin/env bash
# The edge cases of issue 24 on this checkout: bad arguments, an unwritable --results-dir, a disk-full save
# into a small tmpfs (needs root to mount), two concurrent saves, a torn file, piped output.
#   usage: bash apps/benchmarks/scripts/check_edges.sh PYTHON   (PYTHON has the packages importable)
PY=${1:-python}
W=$(mktemp -d)
run() { echo "\$ $*"; "$@"; echo "-> exit $?"; }
echo "### empty lists, out of range (exit 2, one line, nothing written)"
for a in "e2e --context ," "e2e --precision=" "e2e --size ," "shardopt --optimizers ," "flash --seq 0" "flash --dims 0" "flash --batch -2" "flash --batch 0" "flash --rep -5" "shardopt --nproc 0" "ddp --nproc 0" "allreduce --sizes-mb ," "attention --T 0" "accounting --tokens ,"; do
  run $PY -m benchmarks.$a --results-dir $W/r 2>&1
done
ls $W/r 2>&1 | head -1
echo "### unwritable results dir (a path under a file)"
touch $W/file
run $PY -m benchmarks.accounting --results-dir $W/file/results 2>&1
echo "### an existing e2e_train.csv survives 'e2e --context ,'"
mkdir -p $W/keep/cpu && printf '# device: cpu\nsize,step ms\ntiny,1.0\n' > $W/keep/cpu/e2e_train.csv
md5sum $W/keep/cpu/e2e_train.csv; $PY -m benchmarks.e2e --context , --results-dir $W/keep 2>/dev/null; md5sum $W/keep/cpu/e2e_train.csv
echo "### disk-full save into a small tmpfs"
mkdir -p $W/tmpfs && mount -t tmpfs -o size=96k tmpfs $W/tmpfs && {
  $PY -m benchmarks.accounting --results-dir $W/tmpfs > /dev/null && echo "first run: ok"
  (cd $W/tmpfs/analytic && md5sum *.csv *.md > $W/before.md5)
  avail=$(df --output=avail -k $W/tmpfs | tail -1); dd if=/dev/zero of=$W/tmpfs/filler bs=1k count=$((avail - 4)) 2>/dev/null
  df -k $W/tmpfs | tail -1
  run $PY -m benchmarks.accounting --results-dir $W/tmpfs --h100-gb 81 2>&1 | grep -v "^wrote\|^$\|^|\|^[A-Z]" 
  echo "files that changed (each rewritten whole before the disk filled):"; (cd $W/tmpfs/analytic && md5sum -c $W/before.md5 2>/dev/null | grep -v ': OK$')
  echo "leftover temporary files:"; ls -a $W/tmpfs/analytic | grep '\.tmp$' || echo none
  $PY -c "
import sys, pathlib
from benchmarks.common import read_results
for p in sorted(pathlib.Path('$W/tmpfs/analytic').glob('*.csv')):
    df, meta = read_results(p); print(p.name, 'parses:', len(df), 'rows,', meta['command'])"
  rm $W/tmpfs/filler
  run $PY -m benchmarks.report --results-dir $W/tmpfs --out $W/rep/report.md 2>&1 | tail -1
  umount $W/tmpfs; }
echo "### two concurrent saves of the same files"
$PY -m benchmarks.accounting --results-dir $W/conc --h100-gb 80 > $W/a.log 2>&1 & $PY -m benchmarks.accounting --results-dir $W/conc --h100-gb 81 > $W/b.log 2>&1 & wait
$PY -c "
import pathlib
from benchmarks.common import read_results
for p in sorted(pathlib.Path('$W/conc/analytic').glob('*.csv')):
    df, meta = read_results(p); print(p.name, 'whole:', len(df), 'rows, from', meta['command'])
print('leftover temporary files:', [p.name for p in pathlib.Path('$W/conc/analytic').iterdir() if p.suffix == '.tmp'])"
echo "### a torn file is refused by the report (exit 1, named)"
head -c 300 $W/conc/analytic/accounting_memory.csv > $W/t && mv $W/t $W/conc/analytic/accounting_memory.csv
run $PY -m benchmarks.report --results-dir $W/conc --out $W/rep2/report.md 2>&1 | tail -2
grep -A3 "Not read" $W/rep2/report.md
echo "### piped: benchmarks.accounting --no-save | cat"
$PY -m benchmarks.accounting --no-save | cat | sed -n '20,32p'
rm -rf $W
