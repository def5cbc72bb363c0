from kvctl.output.sink import Column, Output, OutputFormat, View

__all__ = ["Column", "Output", "OutputFormat", "View"]
