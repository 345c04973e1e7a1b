#!/bin/bash
# The container HEALTHCHECK: GET /health on 127.0.0.1:$TANDEM_HEALTH_PORT answers 200 (exit 0), else exit 1.
# Plain bash (/dev/tcp), so a probe costs milliseconds of CPU: no Python interpreter starts.
port=${TANDEM_HEALTH_PORT:-8080}
exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 1
printf 'GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' >&3
IFS=' ' read -r -t 5 _ code _ <&3 || exit 1
[ "$code" = 200 ]
