"""Pure pipeline simulator (no torch): schedules' op order and an event-driven engine."""
