#!/bin/sh
# Prints ferry's version, which every build carries (ferryd --version,
# GET /v1/status) and the Debian package is named by. It comes from
# `git describe` and is always a valid Debian version, ordered as the
# commits are:
#   at tag vX.Y.Z                  X.Y.Z
#   N commits after tag vX.Y.Z     X.Y.Z+git<YYYYMMDD>.<N>.<hash>
#   no v* tag in the history       0.0~git<YYYYMMDD>.<N>.<hash>, N counting
#                                  every commit (~ sorts below any release)
#   uncommitted changes            the above + .dirty
#   not a git checkout (tarball)   0.0~unknown
# <YYYYMMDD> is the commit's date and <hash> its 7-digit short hash. A
# hyphen in a tag becomes ~ (v1.2.0-rc1 is 1.2.0~rc1, below 1.2.0), since
# the package is native and has no Debian revision. A shallow clone
# miscounts N: build packages from a full clone.
set -eu
cd "$(dirname "$0")/.."
d=$(git describe --tags --match 'v[0-9]*' --long --dirty --abbrev=7 --always 2>/dev/null) || {
	echo 0.0~unknown
	exit 0
}
dirty=
case $d in *-dirty) dirty=.dirty d=${d%-dirty} ;; esac
date=$(git log -1 --format=%cd --date=format:%Y%m%d)
case $d in
v*-*-g*)
	tag=${d%-*-g*}
	rest=${d#"$tag"-}
	n=${rest%-g*}
	tag=$(echo "${tag#v}" | tr - '~')
	if [ "$n" = 0 ]; then
		v=$tag
	else
		v=$tag+git$date.$n.${rest#*-g}
	fi
	;;
*) v=0.0~git$date.$(git rev-list --count HEAD).$d ;;
esac
echo "$v$dirty"
