"""What people read of a study: text, HTML, SLO and speculation sections, dashboard notes, live
progress."""
