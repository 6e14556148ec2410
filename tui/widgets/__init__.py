"""The app's widgets: chat log and prompt, the inspector panels, and the panel deck."""
