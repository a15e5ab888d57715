"""crawl2chat's Prefect flows. Importing them (as a Prefect worker does) turns the
libraries' own terminal notices down, as the command line does (see infra.console)."""

from crawl2chat.infra.console import quiet_libraries

quiet_libraries()
