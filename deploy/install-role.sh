#!/bin/sh
# Installs one image role into the virtualenv /opt/tandem (the Dockerfile's build stage), in two steps so that
# a change to the code rebuilds only the second: `deps` (the role's packages) and `tandem` (the package itself,
# then the checks). Versions come from constraints.txt; torch from $TORCH_INDEX_URL (its CPU build), the rest
# from $PIP_INDEX_URL. With OFFLINE=1 everything comes from the wheelhouse /wheels (`make wheelhouse`).
#   sh install-role.sh slim|torch deps|tandem
set -eu
role=$1
step=$2
case $role in slim|torch) ;; *) echo "install-role.sh: role must be slim or torch, not '$role'" >&2; exit 2;; esac
py=/opt/tandem/bin/python
pip="$py -m pip install --no-cache-dir --disable-pip-version-check --find-links /wheels"
if [ -n "${OFFLINE:-}" ]; then
    pip="$pip --no-index"
    torch_index=""
else
    torch_index="--index-url ${TORCH_INDEX_URL}"
    pip="$pip --index-url ${PIP_INDEX_URL}"
fi
if [ "$step" = deps ]; then
    python3 -m venv /opt/tandem
    if [ "$role" = torch ]; then
        # shellcheck disable=SC2086
        $pip $torch_index -c constraints.txt -r deploy/requirements/torch-index.txt
    fi
    $pip "setuptools>=68" wheel
    $pip -c constraints.txt -r "deploy/requirements/$role.txt"
    if [ "$role" = slim ]; then
        # what the coordinator and buffers never load: grpc and TensorBoard's data server (the coordinator
        # only writes event files), the hub's download backend, the packages' tests
        $py -m pip uninstall -y -q grpcio tensorboard-data-server hf-xet
        rm -rf "$($py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"/*/tests
    fi
    exit 0
fi
$pip --no-deps --no-build-isolation .
$py -m pip uninstall -y -q setuptools wheel pip
if [ "$role" = slim ]; then
    # bytecode only for what these services import (the checks below write it again): most of transformers
    # (its 500-odd model directories), fontTools and matplotlib's other backends are never loaded here
    find /opt/tandem -name __pycache__ -type d -prune -exec rm -rf {} +
fi
$py -c "import services.contracts, services.coordinator.api, services.buffer.store"
if [ "$role" = torch ]; then
    $py -c "import torch, sglang_router, services.trainer.__main__, services.engine.server"
else
    ! $py -c "import torch" 2>/dev/null
    $py -c "from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast; \
import services.coordinator.__main__, services.buffer.__main__, services.coordinator.tb_writer, matplotlib.pyplot"
fi
