"""The k3pipe command line: a thin shell over the library (``k3pipe/``) and the flows (``flows/``).

It lives outside ``k3pipe/`` because it starts Prefect flows; the library itself never imports Prefect.
"""
