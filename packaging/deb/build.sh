#!/usr/bin/env bash
# Makes the ferry .deb out of a tree make install staged (make deb runs it):
#   build.sh DIR VERSION OUTDIR
# DIR/debian/ferry holds the staged files; this adds what a Debian package
# has beyond them (the maintainer scripts, conffiles, md5sums, the control
# file with the dependencies dpkg-shlibdeps finds, the copyright file with
# the licenses of the Go modules linked in, changelog.gz) and writes
# OUTDIR/ferry_VERSION_ARCH.deb with dpkg-deb. No lintian overrides: it
# finds nothing to override.
set -euo pipefail
[[ $# -eq 3 ]] || { echo "usage: $0 DIR VERSION OUTDIR" >&2; exit 2; }
dir=$1 version=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
root=$dir/debian/ferry
export PATH="$PATH:/usr/local/go/bin"
umask 022

dpkg --validate-version "$version" || {
	echo "build.sh: $version is not a Debian version: see scripts/version.sh for the form, or fix VERSION=" >&2
	exit 1
}
arch=$(dpkg --print-architecture)
doc=$root/usr/share/doc/ferry

# The commit's time stamps the changelog, and dpkg-deb uses it for the
# archive's times, so that two builds of one commit match.
if commit=$(git -C "$here" log -1 --format='%H %ct %s' 2>/dev/null); then
	read -r hash SOURCE_DATE_EPOCH subject <<<"$commit"
	entry="Built from commit $hash: $subject"
else
	SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(date +%s)}
	entry="Built from a tree outside git."
fi
export SOURCE_DATE_EPOCH
maintainer=$(sed -n 's/^Maintainer: //p' "$here/control.in")
{
	printf 'ferry (%s) unstable; urgency=medium\n\n' "$version"
	printf '%s\n' "$entry" | fold -s -w 76 | sed '1s/^/  * /; 1!s/^/    /; s/ *$//'
	printf '\n -- %s  %s\n' "$maintainer" "$(LC_ALL=C date -R -u -d "@$SOURCE_DATE_EPOCH")"
} | gzip -9n >"$doc/changelog.gz"

# The license texts of what the binaries link: the Go toolchain's, then
# every module `go version -m` names, from the module cache the build
# filled. As Debian asks, the Apache-2.0 and GPL-2 texts are pointers to
# /usr/share/common-licenses, and a text printed once is not printed again.
declare -A seen=() # a file's md5sum: the name it was printed under
license() { # NAME FILE
	local sum
	sum=$(md5sum <"$2")
	printf '\n\n==== %s ====\n\n' "$1"
	if [[ -n ${seen[$sum]:-} ]]; then
		printf 'The same text as %s, above.\n' "${seen[$sum]}"
		return
	fi
	seen[$sum]=$1
	if grep -q 'GNU GENERAL PUBLIC LICENSE' "$2" && grep -q 'Version 2, June 1991' "$2"; then
		echo "The GNU General Public License, version 2: /usr/share/common-licenses/GPL-2."
		return
	fi
	# The copyright file is UTF-8; freetype's ftl.txt is Latin-1. What an
	# Apache-2.0 file adds around the license's terms (its appendix, a
	# copyright line) stays.
	{ if iconv -f utf-8 -t utf-8 "$2" >/dev/null 2>&1; then cat "$2"; else iconv -f latin1 -t utf-8 "$2"; fi; } |
		awk '!done && /^[ \t]*Apache License[ \t]*$/ { skip = done = 1; print "The Apache License, Version 2.0: /usr/share/common-licenses/Apache-2.0." }
			!skip { print }
			skip && /END OF TERMS AND CONDITIONS/ { skip = 0 }'
}
{
	cat "$here/copyright"
	goroot=$(go env GOROOT)
	for f in LICENSE PATENTS; do license "$(go env GOVERSION): $f" "$goroot/$f"; done
	for b in "$root"/usr/bin/*; do go version -m "$b"; done | awk '$1 == "dep" { print $2 "@" $3 }' | sort -u |
		while read -r mod; do
			mdir=$(go mod download -json "$mod" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
			# Its top-level LICENSE, COPYING and NOTICE files, and the texts
			# a licenses/ folder holds (freetype's LICENSE points there).
			files=$({
				find "$mdir" -maxdepth 1 -type f \( -iname 'licen[cs]e*' -o -iname 'copying*' -o -iname 'notice*' \)
				find "$mdir" -mindepth 2 -maxdepth 2 -type f -ipath "$mdir/licenses/*"
			} | LC_ALL=C sort)
			[[ -n $files ]] || {
				echo "build.sh: Go module $mod has no LICENSE, COPYING or NOTICE file in $mdir: find where it states its license and make build.sh look there" >&2
				exit 1
			}
			for f in $files; do license "$mod: ${f#"$mdir"/}" "$f"; done
		done
} >"$doc/copyright"

install -d "$root/DEBIAN"
install -m 0755 "$here/postinst" "$here/prerm" "$here/postrm" "$root/DEBIAN/"
install -m 0644 "$here/conffiles" "$root/DEBIAN/"
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"

# dpkg-shlibdeps reads debian/control (the source's; a stub names the one
# package) and finds the library packages through this host's dpkg.
printf 'Source: ferry\n\nPackage: ferry\nArchitecture: any\n' >"$dir/debian/control"
depends=$(cd "$dir" && dpkg-shlibdeps -O debian/ferry/usr/bin/*) || {
	echo "build.sh: dpkg-shlibdeps failed: are libibverbs-dev and libc6-dev installed from Debian packages? (make deps)" >&2
	exit 1
}
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e '/^#/d' -e "s|@VERSION@|$version|" -e "s|@ARCH@|$arch|" -e "s|@INSTALLED_SIZE@|$size|" \
	-e "s|@DEPENDS@|${depends#shlibs:Depends=}|" "$here/control.in" >"$root/DEBIAN/control"

mkdir -p "$out"
dpkg-deb --root-owner-group --build "$root" "$out/ferry_${version}_$arch.deb"
