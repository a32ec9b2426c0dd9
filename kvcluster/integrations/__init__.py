"""kvcluster under other serving engines. Each subpackage imports its engine; the core never imports these."""
