#!/usr/bin/env bash
# Side-by-side comparisons, sourced by compare-tcp.sh and compare-raw.sh
# (and by the RDMA comparison with ib_write_bw). One run alternates the
# candidates per size (A B A B ..., or A B C A B C ...), because these
# machines are shared and noisy, and quotes medians as ratios to a base.
#
#   compare UNIT ROUNDS "SIZE..." BASE_NAME BASE_FN NAME FN [NAME FN]...
#
# Each FN is a command called with one size (e.g. 4MiB) that prints one
# number in UNIT. Each size prints one line; ratio= is the first
# candidate's median over the base's, NAME_ratio= each further one's:
#   size=4MiB ferry=9.80Gbit/s raw=11.2Gbit/s iperf3=14.0Gbit/s ratio=0.70 raw_ratio=0.80 runs=3 ferry_runs=...

# median prints the median of its numeric arguments.
median() {
  printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (b > 0) printf "%.2f", a / b; else print "inf"}'; }

compare() {
  local unit=$1 rounds=$2 sizes=$3
  shift 3
  local names=() fns=() i size r v
  while (($#)); do
    names+=("$1")
    fns+=("$2")
    shift 2
  done
  # Candidates first, the base (given first) last, in each line.
  local order=() n=${#names[@]}
  for ((i = 1; i < n; i++)); do order+=("$i"); done
  order+=(0)
  for size in $sizes; do
    local -A runs=()
    for ((r = 1; r <= rounds; r++)); do
      local line="compare: $size round $r/$rounds:"
      for i in "${order[@]}"; do
        v=$("${fns[i]}" "$size") || { echo "compare: ${names[i]} at $size failed" >&2; return 1; }
        runs[$i]+="${runs[$i]:+,}$v"
        line+=" ${names[i]}=$v"
      done
      echo "$line $unit" >&2
    done
    local -A med=()
    for i in "${order[@]}"; do
      # shellcheck disable=SC2086
      med[$i]=$(median ${runs[$i]//,/ })
    done
    local out="size=$size"
    for i in "${order[@]}"; do out+=" ${names[i]}=${med[$i]}$unit"; done
    out+=" ratio=$(ratio "${med[1]}" "${med[0]}")"
    for ((i = 2; i < n; i++)); do out+=" ${names[i]}_ratio=$(ratio "${med[$i]}" "${med[0]}")"; done
    out+=" runs=$rounds"
    for i in "${order[@]}"; do out+=" ${names[i]}_runs=${runs[$i]}"; done
    echo "$out"
    unset runs med
  done
}

# need_tool CMD PACKAGE installs PACKAGE with apt when CMD is missing.
need_tool() {
  command -v "$1" >/dev/null && return 0
  if [[ $(id -u) -ne 0 ]]; then
    echo "compare: $1 is missing: install it (apt-get install -y $2) or run as root" >&2
    return 1
  fi
  echo "compare: installing $2" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >&2
}

# size_bytes SIZE prints a size such as 4MiB or 64KiB in bytes.
size_bytes() {
  local n=${1%%[KMG]iB}
  case $1 in
    *KiB) echo $((n << 10)) ;;
    *MiB) echo $((n << 20)) ;;
    *GiB) echo $((n << 30)) ;;
    *) echo "$1" ;;
  esac
}

# ferrybench_column CSV_COLUMN ARGS... runs "$FERRYBENCH transfer ARGS"
# and prints that column of its one CSV row; its stderr is shown only when
# it fails.
ferrybench_column() {
  local col=$1 out err
  shift
  err=$(mktemp)
  if ! out=$("$FERRYBENCH" transfer --csv "$@" 2>"$err"); then
    cat "$err" >&2
    rm -f "$err"
    return 1
  fi
  rm -f "$err"
  awk -F, -v col="$col" '
    NR == 1 {for (i = 1; i <= NF; i++) if ($i == col) c = i; next}
    NR == 2 && c {print $c; found = 1}
    END {exit !found}' <<<"$out"
}
