#!/bin/sh
# Regenerates examples/coffee.wav, the recording `duplex demo --pipeline cascade` talks through
# the cascade (its speech recognizer hears this sentence well). Needs espeak-ng and sox (Debian:
# apt-get install espeak-ng sox). Run from anywhere; the result is committed.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp /tmp/coffee.XXXXXX.wav)
trap 'rm -f "$tmp"' EXIT
espeak-ng -v en-us -s 175 -w "$tmp" "I would like a cup of coffee please."
# 16 kHz mono 16-bit, with 0.2 s of silence before and after.
sox "$tmp" -r 16000 -c 1 -b 16 "$here/coffee.wav" pad 0.2 0.2
echo "wrote $here/coffee.wav"
