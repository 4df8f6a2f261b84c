#!/bin/sh
# Regenerates examples/hello.wav, the recording `duplex demo` talks through the stack.
# Needs espeak-ng and sox (Debian: apt-get install espeak-ng sox). Run from anywhere;
# the result is committed, so this only runs when the recording should change.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp /tmp/hello.XXXXXX.wav)
trap 'rm -f "$tmp"' EXIT
espeak-ng -v en -s 140 -w "$tmp" "Hello! This is a full duplex speech demo."
# 16 kHz mono 16-bit: the parrot model's native format, so the demo needs no resampling.
sox "$tmp" -r 16000 -c 1 -b 16 "$here/hello.wav"
echo "wrote $here/hello.wav"
