# %post of rfaas-manager and rfaas-accounting: their units run as the system
# user rfaas, which owns /var/lib/rfaas. Enables and starts nothing.
getent passwd rfaas >/dev/null ||
    useradd --system --user-group --home-dir /var/lib/rfaas --no-create-home \
        --shell /sbin/nologin --comment "rfaas manager and accounting" rfaas
if [ ! -d /var/lib/rfaas ]; then
    install -d -m 0700 -o rfaas -g rfaas /var/lib/rfaas
elif [ "$(stat -c %U /var/lib/rfaas)" = root ]; then
    chown rfaas:rfaas /var/lib/rfaas
fi
systemctl daemon-reload >/dev/null 2>&1 || :
