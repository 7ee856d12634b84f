# shellcheck shell=bash
# Sourced by scripts/gpu_build and scripts/debian13: the Debian archive that this machine's own
# apt uses, so that no script names a host.
#
#   debian_mirror [WHO]   prints the URI of the first enabled `deb` entry among this machine's apt
#                         sources whose suite is a plain Debian release (a codename such as
#                         bookworm, trixie, sid, or stable/testing/unstable/oldstable; not
#                         -security, -updates, -backports) with the component main. WHO prefixes
#                         the error (default: the calling script's name).
#
# The sources are read as apt reads them: $APT_SOURCES_ROOT/sources.list (one-line format,
# `deb [options] URI suite components...`), then $APT_SOURCES_ROOT/sources.list.d/*.list (one-line)
# and *.sources (deb822 stanzas: Types, URIs, Suites, Components, Enabled) in name order.
# APT_SOURCES_ROOT defaults to /etc/apt (tests point it at fake files). DIFFTRAIN_DEBIAN_MIRROR,
# when set, is printed instead. With no Debian archive among the sources it prints one line on
# stderr saying to set DIFFTRAIN_DEBIAN_MIRROR, and returns 1.

# A plain Debian release: the codenames since 2.0, the next ones, and the aliases.
_apt_mirror_release='^(hamm|slink|potato|woody|sarge|etch|lenny|squeeze|wheezy|jessie|stretch|buster|bullseye|bookworm|trixie|forky|duke|sid|stable|testing|unstable|oldstable|oldoldstable)$'

# One-line format: prints the URI of the first matching entry of the file $1.
_apt_mirror_one_line() {
  awk -v release="$_apt_mirror_release" '
    { sub(/#.*/, "") }
    $1 != "deb" { next }
    {
      line = $0
      sub(/^[ \t]*deb[ \t]+/, "", line)
      # Options: [ key=value ... ], possibly with spaces inside the brackets.
      if (line ~ /^\[/) { if (!sub(/^\[[^]]*\][ \t]*/, "", line)) next }
      n = split(line, f, /[ \t]+/)
      if (n < 3 || f[1] ~ /^cdrom:/ || f[2] !~ release) next
      for (i = 3; i <= n; i++) if (f[i] == "main") { print f[1]; exit }
    }' "$1"
}

# deb822 format: prints the first URI of the first matching stanza of the file $1.
_apt_mirror_deb822() {
  awk -v release="$_apt_mirror_release" '
    function has(list, word,   w, n, i) {
      n = split(list, w, /[ \t]+/)
      for (i = 1; i <= n; i++) if (w[i] == word) return 1
      return 0
    }
    function flush(   s, u, ns, nu, i) {
      if (!done && has(v["types"], "deb") && tolower(v["enabled"]) != "no" && has(v["components"], "main")) {
        ns = split(v["suites"], s, /[ \t]+/)
        nu = split(v["uris"], u, /[ \t]+/)
        for (i = 1; i <= ns; i++)
          if (s[i] ~ release && nu > 0 && u[1] !~ /^cdrom:/) { print u[1]; done = 1; break }
      }
      delete v
      key = ""
    }
    /^[ \t]*#/ { next }
    /^[ \t]*$/ { flush(); next }
    function trim(s) { sub(/^[ \t]+/, "", s); sub(/[ \t]+$/, "", s); return s }
    /^[ \t]/ { if (key != "") v[key] = trim(v[key] " " trim($0)); next }
    index($0, ":") > 0 {
      key = tolower(trim(substr($0, 1, index($0, ":") - 1)))
      v[key] = trim(substr($0, index($0, ":") + 1))
    }
    END { flush() }' "$1"
}

debian_mirror() {
  local who=${1:-${0##*/}}
  if [ -n "${DIFFTRAIN_DEBIAN_MIRROR:-}" ]; then
    printf '%s\n' "$DIFFTRAIN_DEBIAN_MIRROR"
    return 0
  fi
  local root=${APT_SOURCES_ROOT:-/etc/apt} file uri
  local files=("$root/sources.list")
  # apt reads sources.list.d in name order, both formats together.
  local d
  while IFS= read -r d; do files+=("$d"); done < <(
    find "$root/sources.list.d" -maxdepth 1 \( -name '*.list' -o -name '*.sources' \) \( -type f -o -type l \) 2>/dev/null |
      LC_ALL=C sort)
  for file in "${files[@]}"; do
    [ -r "$file" ] || continue
    case "$file" in
      *.sources) uri=$(_apt_mirror_deb822 "$file") ;;
      *) uri=$(_apt_mirror_one_line "$file") ;;
    esac
    if [ -n "$uri" ]; then
      printf '%s\n' "$uri"
      return 0
    fi
  done
  echo "$who: no Debian archive among this machine's apt sources ($root/sources.list, $root/sources.list.d): set DIFFTRAIN_DEBIAN_MIRROR=<URI of a Debian mirror>" >&2
  return 1
}
