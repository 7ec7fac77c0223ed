#!/bin/sh
# Regenerate the gRPC/protobuf modules beside robustd/api/v1/robustd.proto. Run after editing it.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. robustd/api/v1/robustd.proto
