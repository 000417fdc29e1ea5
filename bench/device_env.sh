# Sourced by the bench/device*.sh scripts on the device machine: install the carried wheels (.whl/, see the tool
# library's device README) beside the image's packages, and the environment every part runs under.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
quiet() { grep --line-buffered -v -E "USDT|UserWarning|warn\(|_warn_once|profiler.py|pkg_resources"; }
