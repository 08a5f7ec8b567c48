# Sourced before `pip install` in the image builds (`. /tmp/extra/pip-env.sh && pip install ...`).
# A plain build (a user's CI, the public base images) has no extras and this does nothing. `make images`
# (deploy/docker/images.sh) puts .image-build/ in the build context, holding
#   ca/*.crt   the build machine's extra CA certificates (a TLS-intercepting proxy in front of PyPI):
#              trusted by this one command through PIP_CERT, never written into a layer of the image;
#   wheels/    local wheels preferred to PyPI's (the CPU build of torch).
if [ -d /tmp/extra/ca ]; then
    cat /etc/ssl/certs/ca-certificates.crt /tmp/extra/ca/*.crt > /tmp/pip-ca.crt 2>/dev/null || cat /tmp/extra/ca/*.crt > /tmp/pip-ca.crt
    export PIP_CERT=/tmp/pip-ca.crt
fi
if [ -d /tmp/extra/wheels ]; then
    export PIP_FIND_LINKS=/tmp/extra/wheels
fi
