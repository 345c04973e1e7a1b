#!/bin/sh
# Installs Tandem and one image role's packages into the virtualenv /opt/tandem (the Dockerfile's build stage).
# Versions come from constraints.txt; torch from $TORCH_INDEX_URL (its CPU build), the rest from
# $PIP_INDEX_URL. With OFFLINE=1 everything comes from the wheelhouse in /wheels (`make wheelhouse`)
# and no index is asked.
#   sh install-role.sh slim|torch
set -eu
role=$1
case $role in slim|torch) ;; *) echo "install-role.sh: role must be slim or torch, not '$role'" >&2; exit 2;; esac
python3 -m venv /opt/tandem
pip="/opt/tandem/bin/python -m pip install --no-cache-dir --disable-pip-version-check --find-links /wheels"
if [ -n "${OFFLINE:-}" ]; then
    pip="$pip --no-index"
    torch_index=""
else
    torch_index="--index-url ${TORCH_INDEX_URL}"
    pip="$pip --index-url ${PIP_INDEX_URL}"
fi
if [ "$role" = torch ]; then
    # shellcheck disable=SC2086
    $pip $torch_index -c constraints.txt -r deploy/requirements/torch-index.txt
fi
$pip "setuptools>=68" wheel
$pip -c constraints.txt -r "deploy/requirements/$role.txt"
$pip --no-deps --no-build-isolation .
if [ "$role" = slim ]; then
    # what an image that runs no model never loads: the models' modeling code, TensorBoard's server side
    # (grpc, its data server: the coordinator only writes event files), the hub's download backend, tests
    /opt/tandem/bin/python -m pip uninstall -y -q grpcio tensorboard-data-server hf-xet
    site=$(/opt/tandem/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    find "$site/transformers/models" -name 'modeling_*' -delete
    rm -rf "$site"/*/tests
fi
/opt/tandem/bin/python -m pip uninstall -y -q setuptools wheel pip
/opt/tandem/bin/python -c "import services.contracts, services.coordinator.api, services.buffer.store"
if [ "$role" = torch ]; then
    /opt/tandem/bin/python -c "import torch, sglang_router, services.trainer.__main__, services.engine.server"
else
    ! /opt/tandem/bin/python -c "import torch" 2>/dev/null
    /opt/tandem/bin/python -c "from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast; \
import services.coordinator.__main__, services.buffer.__main__, services.coordinator.tb_writer, matplotlib.pyplot"
fi
