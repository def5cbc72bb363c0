
#compdef kvctl

_kvctl_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _KVCTL_COMPLETE=complete_zsh kvctl)
}

compdef _kvctl_completion kvctl

