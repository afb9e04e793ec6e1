"""LXD's own clients, unchanged, against a real daemon: ``lxc`` (5.0) and pylxd."""
