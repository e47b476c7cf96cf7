#!/usr/bin/env bash
# Makes (or reuses) the environment in which tests/test_recorder_lerobot.py reads a
# fleet-written dataset with LeRobot's own, unmodified LeRobotDataset (issue 45).
#
# lerobot 0.4.4 is the last release for Python 3.11 and reads LeRobotDataset v3. Its
# metadata pins torch<2.11 and torchvision<0.26: with pip that takes CUDA builds of several
# GB from PyPI. This machine keeps torch 2.14.1 and torchvision 0.29.1 for Python 3.11 on
# disk (pip takes them without a download), so lerobot is installed without its pins
# (--no-deps) beside them, with the packages its dataset modules import. Reading a dataset
# touches none of the torch API that changed between 2.10 and 2.14.
#
# Usage: tests/lerobot_env.sh [DIR]   (DIR defaults to .venv-lerobot in the repository root)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
env_dir="${1:-$root/.venv-lerobot}"
python="${PYTHON:-python3.11}"
if [ -x "$env_dir/bin/python" ] && "$env_dir/bin/python" -c "import lerobot.datasets.lerobot_dataset" 2>/dev/null; then
    echo "lerobot env ready: $env_dir"
    exit 0
fi
[ -x "$env_dir/bin/python" ] || "$python" -m venv "$env_dir"
pip="$env_dir/bin/pip"
"$pip" install --quiet --upgrade pip
"$pip" install --quiet torch==2.14.1 torchvision==0.29.1
"$pip" install --quiet --no-deps lerobot==0.4.4
"$pip" install --quiet \
    "datasets>=4.0.0,<5.0.0" "huggingface-hub>=0.34.2,<0.36.0" "av>=15.0.0,<16.0.0" \
    "jsonlines>=4.0.0,<5.0.0" "packaging>=24.2,<26.0" "draccus==0.10.0" \
    "deepdiff>=7.0.1,<9.0.0" "einops>=0.8.0,<0.9.0" "termcolor>=2.4.0,<4.0.0" \
    "imageio>=2.34.0,<3.0.0" "accelerate>=1.10.0,<2.0.0" pandas pyarrow fsspec pillow tqdm
"$env_dir/bin/python" -c "import lerobot.datasets.lerobot_dataset" 
echo "lerobot env ready: $env_dir"
