#!/usr/bin/env bash
# Side-by-side comparisons, sourced by compare-tcp.sh and compare-raw.sh
# (and by the RDMA comparison with ib_write_bw). One run alternates A B A B
# per size, because these machines are shared and noisy, and quotes the
# medians as a ratio A/B.
#
#   compare NAME_A FN_A NAME_B FN_B UNIT ROUNDS SIZE...
#
# FN_A and FN_B are commands called with one size (e.g. 4MiB) that print
# one number in UNIT; each size prints one line:
#   size=4MiB ferry=12.31Gbit/s iperf3=14.02Gbit/s ratio=0.88 runs=3 ferry_runs=12.1,12.3,12.6 iperf3_runs=...

# median prints the median of its numeric arguments.
median() {
  printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'
}

compare() {
  local name_a=$1 fn_a=$2 name_b=$3 fn_b=$4 unit=$5 rounds=$6
  shift 6
  local size a b
  for size in "$@"; do
    local as=() bs=()
    for ((r = 1; r <= rounds; r++)); do
      a=$("$fn_a" "$size") || { echo "compare: $name_a at $size failed" >&2; return 1; }
      b=$("$fn_b" "$size") || { echo "compare: $name_b at $size failed" >&2; return 1; }
      as+=("$a")
      bs+=("$b")
      echo "compare: $size round $r/$rounds: $name_a=$a $name_b=$b $unit" >&2
    done
    local ma mb
    ma=$(median "${as[@]}")
    mb=$(median "${bs[@]}")
    printf 'size=%s %s=%s%s %s=%s%s ratio=%s runs=%d %s_runs=%s %s_runs=%s\n' \
      "$size" "$name_a" "$ma" "$unit" "$name_b" "$mb" "$unit" \
      "$(awk -v a="$ma" -v b="$mb" 'BEGIN {if (b > 0) printf "%.2f", a / b; else print "inf"}')" \
      "$rounds" "$name_a" "$(IFS=,; echo "${as[*]}")" "$name_b" "$(IFS=,; echo "${bs[*]}")"
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
