"""Who may hold an agent link: the cluster's CA and every certificate it signs.

The CA and its rotation, the CA shared by leaders in HA, enrollment of a new host, renewal
of short-lived agent certificates, who is dialing, and the direct data path's TLS.
"""
