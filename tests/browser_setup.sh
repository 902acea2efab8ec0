#!/usr/bin/env bash
# Installs Debian's headless Chromium for the browser test when it is missing.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then exit 0; fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
        echo "chromium is missing and we are not root: the browser test will be skipped"; exit 0; fi
fi
echo "Installing chromium for the browser test"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
