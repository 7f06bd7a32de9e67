#!/bin/sh
# Render Alertmanager's config with the webhook URL from the environment, then run the given command.
# Alertmanager does not expand variables itself. awk's index/substr copy the URL literally,
# so characters such as & | / in it are safe (sed would interpret them).
set -eu
in="${AMPWATCH_AM_CONFIG:-/etc/alertmanager/alertmanager.yml}"
out="${AMPWATCH_AM_RENDERED:-/tmp/alertmanager.yml}"
placeholder='http://ampwatch-webhook.invalid/alerts'
url="${AMPWATCH_ALERT_WEBHOOK_URL:-$placeholder}"
awk -v placeholder="$placeholder" -v url="$url" '{
  i = index($0, placeholder)
  if (i) $0 = substr($0, 1, i - 1) url substr($0, i + length(placeholder))
  print
}' "$in" > "$out"
exec "$@"
