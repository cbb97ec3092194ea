# bench/ab_builds.sh: sourced by the A/B scripts (gemm_ab.sh, layer_ab.sh). ab_builds "$@" reads
# NAME=PATH arguments into BIN[NAME] and names (in order) and sets reversed (the reverse order);
# a path that is not an executable stops the script, naming it.
declare -A BIN
names=()
reversed=()
ab_builds() {
  local script=$1; shift
  [ $# -ge 1 ] || { echo "usage: $script NAME=PATH [NAME=PATH ...]" >&2; exit 2; }
  local a name path i
  for a in "$@"; do
    name=${a%%=*}; path=${a#*=}
    [ -x "$path" ] || { echo "$script: $name: no executable at $path" >&2; exit 2; }
    BIN[$name]=$path; names+=("$name")
  done
  for (( i=${#names[@]}-1; i>=0; i-- )); do reversed+=("${names[$i]}"); done
}
