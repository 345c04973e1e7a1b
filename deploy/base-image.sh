#!/bin/sh
# Builds a Debian bookworm base image with Python 3.11 from Debian's archive alone (no container
# registry): debootstrap --variant=minbase, then `docker import`. Cached by its tag: an image of
# that tag already present is kept. Pass the result as BASE_IMAGE to the Dockerfiles; with the extra
# packages redis-server,redis-tools it serves as compose's REDIS_IMAGE.
#   sh deploy/base-image.sh [TAG] [EXTRA_PACKAGES] [MIRROR]   (defaults: tandem-base:bookworm, none, deb.debian.org)
set -eu
tag=${1:-tandem-base:bookworm}
extra=${2:+,$2}
mirror=${3:-http://deb.debian.org/debian}
if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag: present"
    exit 0
fi
command -v debootstrap >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap; }
root=$(mktemp -d /tmp/tandem-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates$extra bookworm "$root" "$mirror"
# what no service reads: package caches, docs, manuals, message translations (33 MB; C.UTF-8 needs none)
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc "$root"/usr/share/man \
    "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$tag"
echo "base image $tag: built"
