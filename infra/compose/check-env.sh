#!/bin/sh
# Refuses to start the stack with a secret left empty, too short, or equal to the
# placeholder .env.example ships (compose's ${VAR:?} only catches unset ones).
# Usage: check-env.sh PATH/TO/.env.example   (the secrets come from the environment)
set -u
example=${1:?usage: check-env.sh PATH/TO/.env.example}
[ -r "$example" ] || { echo "check-env: cannot read $example" >&2; exit 2; }
min_length=${CHECK_ENV_MIN_LENGTH:-12}
failed=0
names=$(sed -nE 's/^([A-Z0-9_]*(PASSWORD|SECRET|TOKEN))=.*/\1/p' "$example")
[ -n "$names" ] || { echo "check-env: $example names no secret" >&2; exit 2; }
for name in $names; do
    placeholder=$(sed -n "s/^$name=//p" "$example" | head -n 1)
    eval "value=\${$name:-}"
    if [ -z "$value" ]; then
        echo "check-env: $name is not set; set it in .env" >&2; failed=1
    elif [ "$value" = "$placeholder" ]; then
        echo "check-env: $name still has the placeholder value of .env.example; set your own in .env" >&2; failed=1
    elif [ "${#value}" -lt "$min_length" ]; then
        echo "check-env: $name is shorter than $min_length characters; use a long random value" >&2; failed=1
    fi
done
[ "$failed" -eq 0 ] && echo "check-env: secrets set"
exit "$failed"
